"""`out=sglang`: SGLang's offline engine (`sglang.Engine`) behind the `LLMEngine` contract, token ids
in and out. The user's manual (flags, sampling, streaming modes, prefill/decode, KV events) is
docs/engines/sglang.md.

Contract: written against SGLang's documented Python API (`Engine(**ServerArgs)`,
`async_generate(input_ids=..., stream=True, rid=...)`, `tokenizer_manager.abort_request`,
`shutdown()`, its ZMQ KV event publisher) and checked as Dynamo's SGLang worker uses it, but never
run against the real package: it does not install on the CPU-only machines this project is built
on. tests/unit/test_sglang_adapter.py replaces the engine at that boundary (`_create_backend`,
`_server_args_fields`). Lifecycle and the request stream are engines/library.py's; this module
says how SGLang takes a request, what its outputs mean, and how it aborts and shuts down.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.engine import EngineConfig
from dynamo_graph.backend.errors import EngineError, InvalidArgument
from dynamo_graph.backend.protocol import FinishReason, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.engines.inflight import ActiveRequest
from dynamo_graph.engines.kv_events_zmq import ZmqKvSubscriber
from dynamo_graph.engines.library import LibraryEngine, Parsed, Submission
from dynamo_graph.engines.sglang.args import (
    INSTALL_HINT,
    SglangError,
    check_server_args,
    enable_incremental_output,
    import_sglang,
    sampling_params,
    server_args_from_settings,
)
from dynamo_graph.engines.sglang.kv_events import SglangKvEventBridge
from dynamo_graph.llm.openai import GUIDED_DECODING, AnyRequest
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.llm.model_source import LocalModel
    from dynamo_graph.router.kv.publisher import KvEventSink

log = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 8998  # ServerArgs.disaggregation_bootstrap_port's default
# sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST: a request under it runs one half alone,
# on fake KV (SGLang's warmup), as our health checks of prefill and decode engines do.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
KV_TOPIC = "kv-events"


class SglangEngine(LibraryEngine):
    """SGLang behind the engine contract; see docs/engines/sglang.md."""

    engine_name = "sglang"
    publishes_kv_events = True

    def __init__(self, server_args: Mapping[str, Any], *, default_context_length: int | None = None) -> None:
        super().__init__()
        self.server_args = dict(server_args)
        self.default_context_length = default_context_length
        # SGLang's PD mode: a prefill or decode engine serves only requests paired by a bootstrap.
        self.pd_mode = self.server_args.get("disaggregation_mode")
        self.kv_transfer = self.pd_mode in ("prefill", "decode")
        # What the engine was started with (after our additions), for logs and tests.
        self.launched_args: dict[str, Any] | None = None
        self.incremental = False
        self._backend: Any = None
        self._kv: ZmqKvSubscriber | None = None

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

    def health_check_request(self, config: EngineConfig) -> dict[str, Any] | None:
        """A PD engine serves only paired requests: its health check is paired with nothing,
        under SGLang's fake bootstrap host."""
        payload = super().health_check_request(config)
        if self.kv_transfer and payload is not None:
            alone = {"host": FAKE_BOOTSTRAP_HOST, "port": DEFAULT_BOOTSTRAP_PORT, "room": 0}
            payload["bootstrap_info"] = alone
        return payload

    # ---- lifecycle -----------------------------------------------------------------------------

    @property
    def _started(self) -> bool:
        return self._backend is not None

    async def _start(self, worker_id: int) -> EngineConfig:
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
        config = self._engine_config(kwargs)
        self.context_length = config.context_length
        return config

    def _engine_config(self, kwargs: Mapping[str, Any]) -> EngineConfig:
        info: dict[str, Any] = {}
        get_info = getattr(self._backend, "get_server_info", None)
        if callable(get_info):
            try:
                info = dict(get_info() or {})
            except Exception as err:  # informational only
                log.debug("sglang: get_server_info failed: %s", err)
        host, port = self._bootstrap_address() if self.pd_mode == "prefill" else (None, None)
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
            bootstrap_host=host,
            bootstrap_port=port,
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

    async def _shutdown(self) -> None:
        await self._close_kv()
        backend, self._backend = self._backend, None
        if backend is not None:
            self._emit_cleared(self._local_ranks(self.launched_args or {}))
            try:
                backend.shutdown()
            except Exception as err:
                log.warning("sglang: shutdown failed: %s", err)

    async def _abort_request(self, active: ActiveRequest) -> None:
        manager = getattr(self._backend, "tokenizer_manager", None)
        if manager is not None and hasattr(manager, "abort_request"):
            manager.abort_request(rid=active.rid, abort_all=False)
            return
        result = self._backend.abort_request(rid=active.rid, abort_all=False)
        if inspect.isawaitable(result):
            await result

    # ---- requests ------------------------------------------------------------------------------

    def generate(
        self, request: PreprocessedRequest | AnyRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        if not self.kv_transfer:
            return self._stream(request, context)
        info = request.bootstrap_info if isinstance(request, PreprocessedRequest) else None
        if info is None:
            raise EngineError(
                f"sglang: an engine in disaggregation_mode {self.pd_mode} only serves requests paired by a "
                "bootstrap room (a decode engine cannot prefill locally)"
            )
        # Both halves name the prefill engine's bootstrap server and the room: SGLang pairs them.
        bootstrap = {"bootstrap_host": info.host, "bootstrap_port": info.port, "bootstrap_room": info.room}
        return self._stream(request, context, bootstrap)

    def _params(self, request: PreprocessedRequest, transfer: Any) -> dict[str, Any]:
        return sampling_params(request, context_length=self.context_length)

    async def _submit(self, job: Submission) -> Any:
        """`transfer`: the bootstrap triple that pairs the request with its other half (PD mode)."""
        kwargs: dict[str, Any] = {
            "input_ids": job.prompt,
            "sampling_params": job.params,
            "stream": True,
            "rid": job.active.rid,
        }
        kwargs.update(job.transfer or {})
        if job.request.dp_rank is not None:
            kwargs["data_parallel_rank"] = job.request.dp_rank
        if job.request.cache_salt:  # SGLang keys its radix cache by it (docs/security.md)
            kwargs["cache_salt"] = job.request.cache_salt
        return await self._backend.async_generate(**kwargs)

    def _parse(self, output: Any, sent: int, request: PreprocessedRequest) -> Parsed:
        """`{"output_ids", "meta_info"}`: incremental ids as they come, cumulative ones sliced past
        what was sent, at once (SGLang may keep appending to the list it handed us)."""
        meta = output.get("meta_info") or {}
        ids = output.get("output_ids") or []
        finish = meta.get("finish_reason")
        return Parsed(
            token_ids=list(ids) if self.incremental else list(ids[sent:]),
            finished=bool(finish),
            reason=finish,
            cached_tokens=meta.get("cached_tokens"),
        )

    def _finish_reason(self, reason: Any) -> tuple[FinishReason, str | None]:
        """`{"type": ...}`; an abort we did not ask for is SGLang refusing the request."""
        kind = reason.get("type") if isinstance(reason, Mapping) else reason
        if kind == "abort":
            message = reason.get("message") if isinstance(reason, Mapping) else None
            status = reason.get("status_code") if isinstance(reason, Mapping) else None
            text = f"sglang aborted the request: {message or 'no reason given'}"
            if status is not None and 400 <= int(status) < 500:
                raise InvalidArgument(text)
            raise EngineError(text)
        return super()._finish_reason(kind)
