"""`out=trtllm`: TensorRT-LLM's LLM API (`tensorrt_llm.LLM`, PyTorch backend) behind the `LLMEngine`
contract, token ids in and out. The user's manual (flags, sampling, prefill/decode, KV events) is
docs/engines/trtllm.md.

Contract: written against TensorRT-LLM's documented LLM API (`LLM(**kwargs)`,
`generate_async(inputs=..., streaming=True)`, `RequestOutput.abort()`,
`get_kv_cache_events_async()`, `shutdown()`) and checked as Dynamo's TensorRT-LLM worker uses it,
but never run against the real package: it needs a GPU at import. tests/unit/test_trtllm_adapter.py
replaces the engine at that boundary (`_create_backend`, `_make_sampling_params`,
`_llm_arg_names`). Lifecycle and the request stream are engines/library.py's; this module says how
TensorRT-LLM takes a request, what its outputs mean, and how it aborts and shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.engine import EngineConfig, KvImportError
from dynamo_graph.backend.errors import EngineError
from dynamo_graph.backend.kv_transfer import KvHandoff
from dynamo_graph.backend.protocol import FinishReason, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.engines.inflight import ActiveRequest
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
from dynamo_graph.engines.trtllm.args import (
    DEFAULT_TOKENS_PER_BLOCK,
    TrtllmError,
    check_llm_args,
    disaggregated_fields,
    disaggregated_kwargs,
    import_tensorrt_llm,
    llm_args_from_settings,
    sampling_kwargs,
    transceiver_backend,
    visible_devices,
)
from dynamo_graph.engines.trtllm.kv_events import TrtllmKvEventBridge
from dynamo_graph.llm.openai import GUIDED_DECODING
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.llm.model_source import LocalModel

log = logging.getLogger(__name__)

DEFAULT_EVENT_BUFFER = 1024  # dynamo-run's trtllm default when publishing KV events
KV_POLL_TIMEOUT_S = 0.5
KV_IDLE_S = 0.05


class TrtllmEngine(LibraryEngine):
    """TensorRT-LLM behind the engine contract; see docs/engines/trtllm.md."""

    engine_name = "trtllm"
    publishes_kv_events = True
    # SamplingParams' own checks, and the executor's checks of the request (e.g. too long)
    client_errors = (ValueError, TypeError)

    def __init__(
        self,
        llm_args: Mapping[str, Any],
        *,
        base_gpu_id: int = 0,
        default_context_length: int | None = None,
    ) -> None:
        super().__init__()
        self.llm_args = copy.deepcopy(dict(llm_args))
        self.base_gpu_id = base_gpu_id
        # TensorRT-LLM's KV cache transceiver: only with one can it run as a prefill or decode worker.
        self.transceiver = transceiver_backend(self.llm_args.get("cache_transceiver_config"))
        self.kv_transfer = self.transceiver is not None
        self.default_context_length = default_context_length
        self.launched_args: dict[str, Any] | None = None
        self.cuda_visible_devices: str | None = None
        self._backend: Any = None
        self._bridge: TrtllmKvEventBridge | None = None
        self._kv_task: asyncio.Task[None] | None = None

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

    @property
    def _started(self) -> bool:
        return self._backend is not None

    def _gpu_count(self, kwargs: Mapping[str, Any]) -> int:
        return int(kwargs.get("tensor_parallel_size") or 1) * int(kwargs.get("pipeline_parallel_size") or 1)

    async def _start(self, worker_id: int) -> EngineConfig:
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
        return EngineConfig(
            model_input="tokens",
            context_length=self.context_length,
            kv_cache_block_size=block_size,
            max_num_seqs=kwargs.get("max_batch_size"),
            max_num_batched_tokens=kwargs.get("max_num_tokens"),
            capabilities=list(GUIDED_DECODING),  # GuidedDecodingParams
        )

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

    async def _shutdown(self) -> None:
        if self._kv_task is not None:
            self._kv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._kv_task
            self._kv_task = None
        backend, self._backend = self._backend, None
        if backend is not None:
            if self._bridge is not None:
                self._emit_cleared([0])
            try:
                backend.shutdown()
            except Exception as err:
                log.warning("trtllm: shutdown failed: %s", err)

    async def _abort_request(self, active: ActiveRequest) -> None:
        if active.result is not None:
            active.result.abort()

    # ---- requests ------------------------------------------------------------------------------

    def _params(self, request: PreprocessedRequest, transfer: Any) -> Any:
        return self._make_sampling_params(sampling_kwargs(request, context_length=self.context_length))

    async def _submit(self, job: Submission) -> Any:
        """`transfer`: DisaggregatedParams making it a context-only request (gathered, not
        streamed, as Dynamo's worker sends it) or a generation-only one."""
        extra: dict[str, Any] = {} if job.transfer is None else {"disaggregated_params": job.transfer}
        if job.request.cache_salt:  # TensorRT-LLM's own: its prefix blocks are keyed by it too
            extra["cache_salt"] = job.request.cache_salt
        job.active.result = self._backend.generate_async(
            inputs=job.prompt, sampling_params=job.params, streaming=not job.gather, **extra
        )
        return job.active.result

    def _parse(self, output: Any, sent: int, request: PreprocessedRequest) -> Parsed:
        """The same `RequestOutput` again and again: `outputs[0].token_ids` is cumulative, sliced
        past what was sent (`token_ids_diff`'s offset is reset per response)."""
        outputs = getattr(output, "outputs", None) or []
        first = outputs[0] if outputs else None
        ids = list(getattr(first, "token_ids", None) or ())
        finish = getattr(first, "finish_reason", None)
        handoff = getattr(first, "disaggregated_params", None) or getattr(
            output, "disaggregated_params", None
        )
        return Parsed(
            token_ids=ids[sent:],
            finished=bool(getattr(output, "finished", False)) or finish is not None,
            reason=finish,
            cached_tokens=getattr(output, "cached_tokens", None),
            handoff=handoff,
        )

    def _finish_reason(self, reason: Any) -> tuple[FinishReason, str | None]:
        if reason == "timeout":
            return "error", "TensorRT-LLM timed the request out"
        return super()._finish_reason(reason)

    # ---- disaggregated prefill/decode (docs/engines/trtllm.md) ------ -------------------------------

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
        params = received.get("handoff")
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
