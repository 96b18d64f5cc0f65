"""`out=sglang`: SGLang's offline engine (`sglang.Engine`) behind the `LLMEngine` contract, tokens in/out.

This adapter was not run against the real sglang package: SGLang cannot be installed on the CPU-only
machines this project is built on (shared/notes/ENGINES.md: its wheel pins a CUDA torch, CUDA
kernels and flashinfer, and `sglang.srt` does not import without them). It is written against
SGLang's documented Python API (`sglang.Engine(**ServerArgs fields)`, `async_generate(input_ids=...,
sampling_params=..., stream=True, rid=...)`, `tokenizer_manager.abort_request(rid=...)`,
`shutdown()`, the ZMQ KV event publisher of `sglang.srt.disaggregation.kv_events`) and checked as
Dynamo's own SGLang worker uses it; tests/unit/test_sglang_adapter.py exercises all of it with the
engine object replaced at that API boundary (`_create_backend`, `_server_args_fields`).

Install: `pip install 'dyngraph[sglang]'` on a CUDA machine. The package is imported only when
this engine starts; without it the error says how to install it (a `RunConfigError`).

Flags -> `ServerArgs` fields (what `sglang.Engine(**kwargs)` receives):

| dyngraph flag | ServerArgs field | note |
|---|---|---|
| --model-path | model_path | the HF folder (or the .gguf file when there is no config.json) |
| (always) | skip_tokenizer_init=True | token ids in and out; the frontend tokenizes |
| --tensor-parallel-size | tp_size | |
| --num-nodes | nnodes | with --node-rank and --leader-addr, only when --num-nodes > 1 |
| --node-rank | node_rank | |
| --leader-addr | dist_init_addr | HOST:PORT of the rank-0 node |
| --base-gpu-id | base_gpu_id | |
| --context-length | context_length | |
| --kv-cache-block-size | page_size | default 16 (as dynamo-run), reported as the card's KV block size |
| --extra-engine-args | any ServerArgs field | a JSON object; see below |

`--extra-engine-args` is a JSON object of `ServerArgs` fields, merged over the flags (a key that
contradicts a flag given on the command line is an error naming both). Keys are checked against
`ServerArgs`' dataclass fields once the package is importable (at start): an unknown key is an
error that lists the valid ones (and the closest matches); SGLang validates the values itself.

Streaming: SGLang's `async_generate(..., stream=True)` yields dicts `{"output_ids": [...],
"meta_info": {...}}`. Whether `output_ids` holds only the new ids or everything generated so far
depends on the version and a setting: with `incremental_streaming_output` (newer releases) or
`stream_output` (<= 0.5.x) true they are incremental, otherwise cumulative (and intermediate
chunks then share one list that SGLang keeps appending to). This adapter turns the setting on
(the field that exists in the installed ServerArgs, as Dynamo does) unless `--extra-engine-args`
sets it, and then reads the stream in the matching mode: incremental ids are passed on as they
come, cumulative ids are sliced at once past what was already sent. Each chunk becomes an
`LLMEngineOutput` delta; the first chunk with tokens carries `meta_info["cached_tokens"]`.

Finish reasons (`meta_info["finish_reason"]["type"]`): "stop" -> stop (a matched stop/eos id is the
last id of the final chunk, as SGLang returns it; the postprocessor hides it), "length" -> length,
"abort" -> cancelled when we aborted it; an abort we did not ask for is SGLang refusing the
request: its message becomes an `InvalidArgument` (status 400) or an `EngineError`.

Sampling (SamplingOptions / StopConditions -> SGLang sampling_params dict): max_tokens ->
max_new_tokens (unset: the context length minus the prompt when known; SGLang's own default is
128), temperature, top_p, top_k (<= 0: -1, the whole vocabulary), min_p, frequency_penalty,
presence_penalty, repetition_penalty, seed -> sampling_seed, logit_bias, min_tokens ->
min_new_tokens, ignore_eos, stop_token_ids (+ the model's eos ids unless ignore_eos), guided_json ->
json_schema, guided_regex -> regex, guided_grammar -> ebnf, guided_choice -> a regex of the choices.
Stop strings are left to the postprocessor (SGLang needs its tokenizer for them). n / best_of > 1
are refused. Note: with skip_tokenizer_init, recent SGLang refuses min_new_tokens > 0 ("requires
tokenizer for eos_token_id"); that error reaches the client as a 400.

Cancellation: a stopped request is aborted in SGLang by its rid (`tokenizer_manager.abort_request`,
or `Engine.abort_request` where that exists) as soon as the context stops, and the stream ends
with finish_reason "cancelled". `cleanup()` aborts what is running, stops the KV event bridge,
emits `cleared` and calls `Engine.shutdown()`; it is idempotent and safe before `start()`.

Disaggregated prefill/decode (SGLang's PD mode; kv_transfer when started in it): `--disaggregation-mode
prefill|decode` becomes ServerArgs' `disaggregation_mode` and needs `disaggregation_transfer_backend`
in `--extra-engine-args` (nixl, mooncake, ...; refused naming it otherwise), with
`disaggregation_bootstrap_port` (SGLang's default 8998) for the prefill engine's bootstrap server.
SGLang pairs the two halves of a request by a bootstrap address and room given to both:
- `prefill`: a fresh room, and SGLang's prefill request (`async_generate(..., bootstrap_host,
  bootstrap_port, bootstrap_room)`) started in the background, as Dynamo's SGLang worker does: the
  handoff carries {bootstrap_host, bootstrap_port, bootstrap_room} (format
  "sglang-connector/1:<backend>") and the answer has NO first token. SGLang's prefill only ends
  after it has sent the KV (and its first token) to the decode engine that joins the room, so a
  first token cannot come back before a decode worker is chosen.
- `generate_from_kv`: the prompt with the same bootstrap triple; SGLang's decode engine pulls the
  KV from the prefill engine and streams from the first token on. It takes the prompt alone
  (a request with tokens after the handoff's prompt is refused: `KvImportError`).
- Neither engine serves a request without a bootstrap (`generate` raises `EngineError`): a decode
  engine cannot prefill locally.
LIMIT: dyngraph's frontend (router/disagg.py) wants the prefill worker's first token and then sends
the decode worker the prompt plus that token; it treats an answer without a token as a failed
prefill. So SGLang prefill/decode workers do not serve through it yet: the frontend would have to
pass a token-less prefill answer's parameters on with the original request, as Dynamo's
PrefillRouter does. Like the rest of this adapter, none of this ran against the real package.

KV events (publishes_kv_events = True): when the serving process sets `kv_event_sink`, the engine
is started with `kv_events_config` pointing SGLang's ZMQ publisher at a SUB socket this adapter
binds on 127.0.0.1 (SGLang's publisher connects to a concrete tcp address and adds the DP rank to
the port; one SUB per local rank with DP attention). A `kv_events_config` given in
`--extra-engine-args` is used as is (SUB connects when SGLang binds: `*`, `ipc://`). Each ZMQ
message `[topic, seq, payload]` carries a msgpack `KVEventBatch`; `BlockStored(block_hashes,
parent_block_hash, token_ids, block_size, lora_id)` becomes `stored` with one `StoredBlock`
(SGLang's block hash, our local hash of the block's tokens) per full block, `BlockRemoved` becomes
`removed` (of blocks we reported), `AllBlocksCleared` becomes `cleared`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import re
import secrets
import socket
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_graph.backend.engine import EngineConfig, KvImportError, LLMEngine
from dynamo_graph.backend.errors import EngineError, EngineShutdown, InvalidArgument
from dynamo_graph.backend.kv_transfer import KvHandoff
from dynamo_graph.backend.protocol import CompletionUsage, FinishReason, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.engines.engine_args import import_engine_package, refuse_flag_conflicts, refuse_unknown_keys
from dynamo_graph.engines.inflight import ActiveRequest, InFlight, checked_prompt
from dynamo_graph.engines.kv_bridge import U64, KvBlockBridge
from dynamo_graph.engines.kv_events_zmq import ZmqKvSubscriber, offset_endpoint
from dynamo_graph.engines.kv_handoff import connector_format, connector_handoff, connector_params
from dynamo_graph.llm.openai import GUIDED_DECODING, AnyRequest
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.llm.model_source import LocalModel
    from dynamo_graph.router.kv.publisher import KvEventSink

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "out=sglang needs SGLang: pip install 'dyngraph[sglang]' "
    "(on a CUDA machine; SGLang's wheels need a CUDA build of torch and GPU kernels)"
)
SOURCE = "--extra-engine-args"
DEFAULT_PAGE_SIZE = 16  # dynamo-run's default --kv-block-size for sglang
DEFAULT_BOOTSTRAP_PORT = 8998  # ServerArgs.disaggregation_bootstrap_port's default
DEFAULT_TRANSFER_BACKEND = "mooncake"  # ServerArgs.disaggregation_transfer_backend's default
BOOTSTRAP_KEYS = frozenset({"bootstrap_host", "bootstrap_port", "bootstrap_room"})
KV_TOPIC = "kv-events"
# ServerArgs fields that make async_generate stream disjoint (incremental) output_ids, newest first.
STREAMING_FIELDS = ("incremental_streaming_output", "stream_output")
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length"}
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
    }
    if cfg.context_length is not None:
        kwargs["context_length"] = cfg.context_length
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


def sampling_params(request: PreprocessedRequest, *, context_length: int | None = None) -> dict[str, Any]:
    """SGLang's sampling_params dict for one request (see the module docstring for the mapping)."""
    sc, so = request.stop_conditions, request.sampling_options
    if (so.n or 1) > 1 or (so.best_of or 1) > 1:
        raise InvalidArgument("n > 1 / best_of > 1 is not supported by out=sglang", param="n")
    params: dict[str, Any] = {}
    max_new = sc.max_tokens
    if max_new is None and context_length:
        max_new = max(context_length - len(request.token_ids), 1)
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
    stop_ids = set(sc.stop_token_ids or ())
    if sc.ignore_eos:
        params["ignore_eos"] = True
    else:
        stop_ids.update(request.eos_token_ids)
        stop_ids.update(sc.stop_token_ids_hidden or ())
    if stop_ids:
        params["stop_token_ids"] = sorted(stop_ids)
    if so.guided_json is not None:
        schema = so.guided_json
        params["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
    elif so.guided_regex is not None:
        params["regex"] = so.guided_regex
    elif so.guided_grammar is not None:
        params["ebnf"] = so.guided_grammar
    elif so.guided_choice:
        params["regex"] = "(" + "|".join(re.escape(choice) for choice in so.guided_choice) + ")"
    return params


class _OutputIds:
    """Turns SGLang's output_ids (incremental, or cumulative) into deltas."""

    __slots__ = ("incremental", "sent")

    def __init__(self, incremental: bool) -> None:
        self.incremental = incremental
        self.sent = 0

    def delta(self, ids: list[int] | None) -> list[int]:
        if not ids:
            return []
        # Cumulative ids are sliced at once: SGLang may keep appending to the list it handed us.
        new = list(ids) if self.incremental else list(ids[self.sent :])
        self.sent += len(new)
        return new


# ---- KV events -----------------------------------------------------------------------------------
# msgspec mirrors of sglang.srt.disaggregation.kv_events (array-like, tagged by class name). Fields
# added by later SGLang versions trail the ones below and are ignored when decoding.


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode


class SglangKvEventBridge(KvBlockBridge):
    """SGLang's KV event batches -> our `KvEventSink` (stored / removed / cleared per DP rank)."""

    engine = "sglang"

    def __init__(self, sink: KvEventSink, block_size: int) -> None:
        super().__init__(sink, block_size)

    def handle_payload(self, payload: bytes, dp_rank: int = 0) -> None:
        self.handle_batch(_decode_batch(payload), dp_rank)

    def handle_batch(self, batch: KVEventBatch, dp_rank: int = 0) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                size = self.event_block_size(event.block_size)
                parent = None if event.parent_block_hash is None else event.parent_block_hash & U64
                hashes = [h & U64 for h in event.block_hashes]
                self.store(parent, hashes, event.token_ids, size, dp_rank)
            elif isinstance(event, BlockRemoved):
                self.remove((h & U64 for h in event.block_hashes), dp_rank)
            else:
                self.clear(dp_rank)


def offset_endpoint_port(endpoint: str, dp_rank: int) -> str:
    """SGLang's rule: rank r publishes on the base port + r (tcp), or `_dp{r}` (inproc)."""
    return offset_endpoint(endpoint, dp_rank, SglangError)


# ---- the engine ----------------------------------------------------------------------------------


class SglangEngine(LLMEngine):
    """SGLang behind the engine contract; see the module docstring."""

    publishes_kv_events = True

    def __init__(self, server_args: Mapping[str, Any], *, default_context_length: int | None = None) -> None:
        self.server_args = dict(server_args)
        self.default_context_length = default_context_length
        # SGLang's PD mode: a prefill or decode engine serves only requests paired by a bootstrap.
        self.pd_mode = self.server_args.get("disaggregation_mode")
        self.kv_transfer = self.pd_mode in ("prefill", "decode")
        self._prefills: set[asyncio.Task[None]] = set()
        # What the engine was started with (after our additions), for logs and tests.
        self.launched_args: dict[str, Any] | None = None
        self.incremental = False
        self.context_length: int | None = None
        self._backend: Any = None
        self._config: EngineConfig | None = None
        self._kv: ZmqKvSubscriber | None = None
        self._active = InFlight()
        self._rids: set[str] = set()
        self._aborts: set[asyncio.Future[Any]] = set()
        self._closed = False

    @classmethod
    def from_config(cls, cfg: EngineSettings, model: LocalModel | None) -> SglangEngine:
        return cls(
            server_args_from_settings(cfg, model),
            default_context_length=model.context_length if model is not None else None,
        )

    # ---- the API boundary (tests replace these) ----------------------------------------------

    def _server_args_fields(self) -> set[str]:
        """The installed SGLang's ServerArgs field names (imports sglang)."""
        import_sglang()
        try:
            from sglang.srt.server_args import ServerArgs
        except Exception as err:
            raise SglangError(f"{INSTALL_HINT} ({type(err).__name__}: {err})") from None
        return {f.name for f in dataclasses.fields(ServerArgs)}

    def _create_backend(self, server_args: dict[str, Any]) -> Any:
        """`sglang.Engine(**server_args)`: launches the scheduler and detokenizer processes."""
        return import_sglang().Engine(**server_args)

    def _bootstrap_address(self) -> tuple[str, int]:
        """Where decode engines reach this prefill engine's bootstrap server: the host of
        dist_init_addr, else SGLANG_HOST_IP, else this host's address (as SGLang's get_ip)."""
        args = self.launched_args or self.server_args
        port = int(args.get("disaggregation_bootstrap_port") or DEFAULT_BOOTSTRAP_PORT)
        addr = args.get("dist_init_addr")
        if addr:
            return str(addr).rsplit(":", 1)[0].strip("[]"), port
        return os.environ.get("SGLANG_HOST_IP") or socket.gethostbyname(socket.gethostname()), port

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self, worker_id: int = 0) -> EngineConfig:
        if self._closed:
            raise EngineShutdown("the sglang engine was shut down")
        if self._config is not None:
            return self._config
        kwargs = dict(self.server_args)
        fields = self._server_args_fields()
        check_server_args(kwargs, fields)
        self.incremental = enable_incremental_output(kwargs, fields)
        if self.kv_event_sink is not None:
            try:
                self._kv = self._open_kv_events(kwargs, self.kv_event_sink)
            except RunConfigError:
                raise
            except Exception as err:  # a bad endpoint in kv_events_config, a port we cannot bind
                raise SglangError(f"sglang: cannot subscribe to KV events: {err}") from err
        try:
            # Blocks while SGLang loads, as in Dynamo's worker (its Engine binds the running loop).
            self._backend = self._create_backend(kwargs)
        except Exception as err:
            await self._close_kv()
            if isinstance(err, RunConfigError):
                raise
            raise SglangError(f"SGLang failed to start: {type(err).__name__}: {err}") from err
        self.launched_args = kwargs
        if self._kv is not None:
            self._kv.start()
        self._config = self._engine_config(kwargs)
        self.context_length = self._config.context_length
        return self._config

    def _engine_config(self, kwargs: Mapping[str, Any]) -> EngineConfig:
        info: dict[str, Any] = {}
        get_info = getattr(self._backend, "get_server_info", None)
        if callable(get_info):
            try:
                info = dict(get_info() or {})
            except Exception as err:  # informational only
                log.debug("sglang: get_server_info failed: %s", err)
        page = int(kwargs.get("page_size") or 1)
        context = getattr(getattr(self._backend, "tokenizer_manager", None), "context_len", None)
        context = context or kwargs.get("context_length") or self.default_context_length
        total_tokens = info.get("max_total_num_tokens")
        dp = int(kwargs.get("dp_size") or 1) if kwargs.get("enable_dp_attention") else 1
        return EngineConfig(
            model_input="tokens",
            context_length=int(context) if context else None,
            kv_cache_block_size=page,
            total_kv_blocks=int(total_tokens) // page if total_tokens else None,
            max_num_seqs=info.get("max_running_requests") or kwargs.get("max_running_requests"),
            data_parallel_size=dp,
            capabilities=list(GUIDED_DECODING),  # json_schema / regex / ebnf (above)
        )

    def _local_ranks(self, kwargs: Mapping[str, Any]) -> list[int]:
        """DP ranks whose schedulers publish on this node (each its own KV cache under DP attention)."""
        if not kwargs.get("enable_dp_attention"):
            return [0]
        dp, nodes = int(kwargs.get("dp_size") or 1), int(kwargs.get("nnodes") or 1)
        local = max(dp // nodes, 1)
        first = int(kwargs.get("node_rank") or 0) * local
        return list(range(first, first + local))

    def _open_kv_events(self, kwargs: dict[str, Any], sink: KvEventSink) -> ZmqKvSubscriber | None:
        if kwargs.get("disable_radix_cache"):
            log.warning("sglang: disable_radix_cache is set, so SGLang reports no KV events")
            return None
        bridge = SglangKvEventBridge(sink, int(kwargs.get("page_size") or 1))
        subscriber = ZmqKvSubscriber(bridge.handle_payload, engine="sglang", error=SglangError)
        ranks = self._local_ranks(kwargs)
        try:
            given = kwargs.get("kv_events_config")
            if given:
                config = json.loads(given)
                if config.get("publisher", "null") != "zmq":
                    log.warning("sglang: kv_events_config publisher is not zmq; KV events are not bridged")
                    subscriber.discard()
                    return None
                endpoint = config.get("endpoint", "tcp://*:5557")
                if endpoint.startswith("inproc://"):
                    log.warning("sglang: an inproc:// KV event endpoint cannot be read from this process")
                    subscriber.discard()
                    return None
                subscriber.attach(endpoint, ranks, config.get("topic", ""))
            else:
                endpoint = subscriber.bind_loopback(ranks, KV_TOPIC)
                kwargs["kv_events_config"] = json.dumps(
                    {"publisher": "zmq", "endpoint": endpoint, "topic": KV_TOPIC}
                )
        except Exception:
            subscriber.discard()
            raise
        return subscriber

    async def _close_kv(self) -> None:
        if self._kv is not None:
            kv, self._kv = self._kv, None
            await kv.close()

    async def drain(self) -> None:
        await self._active.wait_idle()

    async def cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        for active in self._active.values():
            self._abort(active)
        for task in list(self._prefills):
            task.cancel()
        await asyncio.gather(*self._prefills, return_exceptions=True)
        await self._close_kv()
        backend, self._backend = self._backend, None
        if backend is not None:
            sink = self.kv_event_sink
            if sink is not None:
                for rank in self._local_ranks(self.launched_args or {}):
                    with contextlib.suppress(Exception):
                        sink.cleared(rank)
            try:
                backend.shutdown()
            except Exception as err:
                log.warning("sglang: shutdown failed: %s", err)

    async def abort(self, context: Context) -> None:
        await self._active.abort(context, self._abort)

    def _abort(self, active: ActiveRequest) -> None:
        if active.aborted or active.finished or self._backend is None:
            return
        active.aborted = True
        try:
            manager = getattr(self._backend, "tokenizer_manager", None)
            if manager is not None and hasattr(manager, "abort_request"):
                manager.abort_request(rid=active.rid, abort_all=False)
            else:
                result = self._backend.abort_request(rid=active.rid, abort_all=False)
                if inspect.isawaitable(result):
                    task = asyncio.ensure_future(result)
                    self._aborts.add(task)
                    task.add_done_callback(self._aborts.discard)
        except Exception as err:
            log.warning("sglang: aborting request %s failed: %s", active.rid, err)

    # ---- requests ------------------------------------------------------------------------------

    def _rid(self, context: Context) -> str:
        rid, n = context.id, 1
        while rid in self._rids:  # one context may be served twice (a retry); rids must be unique
            n += 1
            rid = f"{context.id}-{n}"
        return rid

    def generate(
        self, request: PreprocessedRequest | AnyRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        if self.kv_transfer:
            raise EngineError(
                f"sglang: an engine in disaggregation_mode {self.pd_mode} only serves requests paired by a "
                "bootstrap room (a decode engine cannot prefill locally)"
            )
        return self._stream(request, context)

    # ---- disaggregated prefill/decode (see the module docstring) -------------------------------

    @property
    def kv_format(self) -> str:
        backend = self.server_args.get("disaggregation_transfer_backend") or DEFAULT_TRANSFER_BACKEND
        return connector_format("sglang", str(backend))

    async def prefill(
        self, request: PreprocessedRequest, context: Context
    ) -> tuple[LLMEngineOutput, KvHandoff | None]:
        """SGLang's prefill of the prompt started under a fresh bootstrap room; the answer has no
        token (SGLang sends the first token with the KV to the decode engine)."""
        if self.pd_mode != "prefill":
            raise EngineError("sglang: prefill needs an engine started with disaggregation_mode prefill")
        checked_prompt(request, "sglang", closed=self._closed, started=self._backend is not None)
        sampling_params(request, context_length=self.context_length)  # refuse a bad request here, not later
        host, port = self._bootstrap_address()
        bootstrap = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": secrets.randbits(63)}
        task = asyncio.create_task(self._run_prefill(self._stream(request, context, bootstrap), context))
        self._prefills.add(task)
        task.add_done_callback(self._prefills.discard)
        return LLMEngineOutput(), connector_handoff(self.kv_format, request.token_ids, bootstrap)

    async def _run_prefill(self, stream: AsyncIterator[LLMEngineOutput], context: Context) -> None:
        try:
            async for _ in stream:
                pass
        except Exception as err:  # the decode engine's own request fails with SGLang's error
            log.warning("sglang: prefill of request %s failed: %s", context.id, err)

    async def generate_from_kv(  # type: ignore[override]
        self, request: PreprocessedRequest, handoff: KvHandoff, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """The prompt under the prefill's bootstrap room: SGLang pulls its KV and first token."""
        if self.pd_mode != "decode":
            raise KvImportError("sglang: this engine was not started with disaggregation_mode decode")
        bootstrap = connector_params(handoff, self.kv_format, request.token_ids)
        if not bootstrap or set(bootstrap) != BOOTSTRAP_KEYS:
            raise KvImportError(f"sglang: the handoff holds no bootstrap address and room: {bootstrap!r}")
        if len(request.token_ids) != handoff.num_tokens:
            raise KvImportError(
                "sglang: the decode engine takes the prefill's prompt alone, not a continuation"
            )
        async for out in self._stream(request, context, bootstrap):
            yield out

    async def _stream(
        self,
        request: PreprocessedRequest | AnyRequest,
        context: Context,
        bootstrap: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[LLMEngineOutput]:
        """A request's stream; `bootstrap` pairs it with the other half in SGLang's PD mode."""
        prompt = checked_prompt(request, "sglang", closed=self._closed, started=self._backend is not None)
        assert isinstance(request, PreprocessedRequest)
        params = sampling_params(request, context_length=self.context_length)
        if context.is_stopped():
            yield LLMEngineOutput(finish_reason="cancelled", completion_usage=CompletionUsage(len(prompt), 0))
            return
        rid = self._rid(context)
        active = ActiveRequest(context, rid)
        self._active.add(active)
        self._rids.add(rid)
        kwargs: dict[str, Any] = {"input_ids": prompt, "sampling_params": params, "stream": True, "rid": rid}
        kwargs.update(bootstrap or {})
        if request.dp_rank is not None:
            kwargs["data_parallel_rank"] = request.dp_rank
        watcher = self._active.watch(active, self._abort)
        stream: Any = None
        ids = _OutputIds(self.incremental)
        first = True
        try:
            try:
                stream = await self._backend.async_generate(**kwargs)
                async for res in stream:
                    meta = res.get("meta_info") or {}
                    out = LLMEngineOutput(token_ids=ids.delta(res.get("output_ids")))
                    finish = meta.get("finish_reason")
                    if first and (out.token_ids or finish):
                        cached = meta.get("cached_tokens")
                        if cached is not None:
                            out.cached_tokens = min(int(cached), len(prompt))
                        first = False
                    if finish or context.is_stopped():
                        reason = self._finish(active, finish)
                        active.finished = True
                        out.finish_reason = reason
                        out.completion_usage = CompletionUsage(
                            prompt_tokens=int(meta.get("prompt_tokens") or len(prompt)),
                            completion_tokens=ids.sent,
                            cached_tokens=meta.get("cached_tokens"),
                        )
                        yield out
                        return
                    if out.token_ids:
                        yield out
            except EngineError:
                raise
            except ValueError as err:  # SGLang's checks of the request (sampling params, length)
                raise InvalidArgument(f"sglang refused the request: {err}") from None
            except Exception as err:
                raise EngineError(f"sglang failed: {type(err).__name__}: {err}") from err
            if context.is_stopped() or active.aborted:
                active.finished = True
                usage = CompletionUsage(len(prompt), ids.sent)
                yield LLMEngineOutput(finish_reason="cancelled", completion_usage=usage)
                return
            raise EngineError("sglang ended the stream without a finish reason")
        finally:
            watcher.cancel()
            if not active.finished:  # our consumer went away: free the engine's slot
                self._abort(active)
            if stream is not None and hasattr(stream, "aclose"):
                with contextlib.suppress(Exception):
                    await stream.aclose()
            self._rids.discard(rid)
            self._active.remove(active)

    def _finish(self, active: ActiveRequest, finish: Any) -> FinishReason:
        if active.context.is_stopped() or active.aborted:
            return "cancelled"
        kind = finish.get("type") if isinstance(finish, Mapping) else str(finish)
        if kind in _FINISH:
            return _FINISH[kind]
        if kind == "abort":
            message = finish.get("message") if isinstance(finish, Mapping) else None
            status = finish.get("status_code") if isinstance(finish, Mapping) else None
            text = f"sglang aborted the request: {message or 'no reason given'}"
            if status is not None and 400 <= int(status) < 500:
                raise InvalidArgument(text)
            raise EngineError(text)
        log.warning("sglang: unknown finish reason %r, reporting stop", finish)
        return "stop"
