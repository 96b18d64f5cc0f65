"""The unified engine contract every engine implements (docs/contracts.md).

An engine is started once, then serves many concurrent `generate` calls, each an async
generator of `LLMEngineOutput` chunks whose last chunk carries a finish reason. Engines of
Tokens-input models receive a `PreprocessedRequest`; engines of Text-input models (which do
their own templating) receive the OpenAI request and put text in their chunks.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from dynamo_graph.backend.errors import EngineError, InvalidArgument
from dynamo_graph.backend.settings import EngineSettings
from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.llm.protocol import LLMEngineOutput, PreprocessedRequest
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from dynamo_graph.backend.command_line import WorkerConfig
    from dynamo_graph.backend.kv_transfer import KvHandoff
    from dynamo_graph.backend.lora import LoraAdapter
    from dynamo_graph.llm.model_source import LocalModel
    from dynamo_graph.router.kv.publisher import KvEventSink

ModelInput = Literal["tokens", "text"]


class KvImportError(EngineError):
    """A KV handoff the engine cannot load (format, size, a sequence too long): the decode
    worker prefills the request locally instead."""


log = logging.getLogger(__name__)

# The finish reasons that travel on the wire; engines may say more (normalize_finish_reason).
WIRE_FINISH_REASONS = frozenset({"stop", "length", "cancelled", "error"})
_FINISH_ALIASES = {
    "eos": "stop",
    "stop": "stop",
    "stop_sequence": "stop",
    "stop_token": "stop",
    "end_turn": "stop",
    "tool_calls": "stop",
    "function_call": "stop",
    "content_filter": "stop",
    "length": "length",
    "max_tokens": "length",
    "max_length": "length",
    "model_length": "length",
    "cancelled": "cancelled",
    "canceled": "cancelled",
    "cancel": "cancelled",
    "abort": "cancelled",
    "aborted": "cancelled",
    "error": "error",
    "failed": "error",
}
_warned_reasons: set[str] = set()


def normalize_finish_reason(reason: str | None) -> str | None:
    """An engine's finish reason as one of stop / length / cancelled / error ("eos", "abort",
    "max_tokens", ... as vLLM, SGLang, TRT-LLM and OpenAI spell them); unknown ones are "stop"
    (the engine ended the sequence itself), with a warning once per spelling."""
    if reason is None:
        return None
    mapped = _FINISH_ALIASES.get(reason) or _FINISH_ALIASES.get(str(reason).lower())
    if mapped is None:
        if reason not in _warned_reasons:
            _warned_reasons.add(reason)
            log.warning("engine finish reason %r is not known: sent as 'stop'", reason)
        return "stop"
    return mapped


class EngineConfig(msgspec.Struct, omit_defaults=True):
    """What an engine reports once started; it feeds the model deployment card."""

    model_input: ModelInput = "tokens"
    served_model_name: str | None = None
    context_length: int | None = None
    kv_cache_block_size: int | None = None
    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # Ranks the engine schedules independently; the kv router treats each as its own target.
    data_parallel_size: int = 1
    # The OpenAI endpoints served ("chat", "completions"); None: both. A text engine that takes
    # only chat requests (out=pystr:FILE) says ["chat"].
    model_type: list[str] | None = None
    # Optional request features the engine honours (llm/openai.py CAPABILITIES); the card carries
    # them and the frontend refuses (400) a request needing one the engine lacks.
    capabilities: list[str] | None = None
    # A prefill engine that pairs with decode engines by a bootstrap room (SGLang): where its
    # bootstrap server listens. The card publishes it; the frontend then sends each request to
    # a prefill and a decode worker at once (router/disagg.py), not prefill first.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None


class LLMEngine(abc.ABC):
    # Engines that report their KV cache (for kv routing) say so; the process serving them then
    # sets `kv_event_sink` before `start()`. It stays None when nobody listens (e.g. in=http).
    publishes_kv_events: bool = False
    kv_event_sink: KvEventSink | None = None
    # Engines that can hand a prompt's KV cache over (disaggregated prefill/decode) implement
    # `prefill` and `generate_from_kv` and say so; only they run as prefill or decode workers.
    # Or they pair the halves themselves: the prefill engine reports its bootstrap address
    # (EngineConfig) and both take requests with `bootstrap_info` in `generate`.
    kv_transfer: bool = False

    @classmethod
    def from_config(cls, settings: EngineSettings, model: LocalModel | None) -> LLMEngine:
        """Build the engine from its settings (model, lengths, parallelism, engine args, the
        arguments after `--`) and the resolved model."""
        return cls()

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> tuple[LLMEngine, WorkerConfig]:
        """Build the engine from a dynamo-run style command line (`sys.argv[1:]` by default):
        `[in=dyn://ns.comp.ep | --endpoint dyn://ns.comp.ep] [MODEL | --model-path P] [--flags]
        [-- ENGINE ARGS]`. Resolves the model, then calls `from_config`. Override to parse
        flags of your own (e.g. those after `--`, in `WorkerConfig.engine_args`)."""
        from dynamo_graph.backend.command_line import parse_worker_args
        from dynamo_graph.llm.model_source import resolve_model

        worker = parse_worker_args(argv)
        settings = worker.engine
        if settings.model_path:
            worker.model = resolve_model(
                settings.model_path, model_config=settings.model_config, model_name=settings.model_name
            )
        return cls.from_config(settings, worker.model), worker

    def health_check_request(self, config: EngineConfig) -> dict[str, Any] | None:
        """A tiny request (in wire form) that proves the engine serves: the worker publishes it
        in its model card (`user_data.health_check_payload`) and, with DYN_HEALTH_CHECK_ENABLED,
        runs it once before registering. None: no health check."""
        if config.model_input == "tokens":
            return {
                "model": config.served_model_name or "health_check",
                "token_ids": [1],
                "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
                "sampling_options": {"temperature": 0.0},
            }
        return {
            "model": config.served_model_name or "health_check",
            "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 1,
        }

    @abc.abstractmethod
    async def start(self, worker_id: int = 0) -> EngineConfig:
        """Load whatever the engine needs; called once before any generate."""

    @abc.abstractmethod
    def generate(
        self, request: PreprocessedRequest | AnyRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """Stream chunks for one request; stop early once `context.is_stopped()`."""

    async def prefill(
        self, request: PreprocessedRequest, context: Context
    ) -> tuple[LLMEngineOutput, KvHandoff | None]:
        """A prefill worker's request: evaluate the prompt, sample the first token, and return
        that token's chunk with the prompt's KV state. The chunk carries a finish reason when the
        request ends at that token (eos, a stop id, max_tokens 1); the handoff is then None.
        Only engines with `kv_transfer` are asked (backend/kv_transfer.py)."""
        raise EngineError(f"{type(self).__name__} cannot run as a prefill worker (no KV transfer)")

    def generate_from_kv(
        self, request: PreprocessedRequest, handoff: KvHandoff, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """A decode worker's request: load `handoff` (the KV of the first `handoff.num_tokens`
        of `request.token_ids`, computed by a prefill worker), evaluate only the tokens after
        them, and stream the rest as `generate` does. Raise `KvImportError` when the handoff
        cannot be loaded before anything was generated: the worker then prefills locally."""
        raise EngineError(f"{type(self).__name__} cannot run as a decode worker (no KV transfer)")

    async def load_lora(self, adapter: LoraAdapter) -> None:
        """Load a LoRA adapter; from then on, requests whose `model` is `adapter.name` run with
        it (backend/lora.py). Engines without adapters refuse, naming themselves."""
        raise InvalidArgument(f"{type(self).__name__} cannot serve LoRA adapters", param="lora_name")

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter `load_lora` loaded; requests for it have stopped being routed here."""
        raise InvalidArgument(f"{type(self).__name__} cannot serve LoRA adapters", param="lora_name")

    def metrics_collectors(self) -> Sequence[Collector]:
        """Prometheus collectors of the engine's own series, served on the worker's /metrics
        (--metrics-port) beside the worker's; called once, after `start`. Read at scrape time,
        so keep them cheap. Default: none."""
        return ()

    async def abort(self, context: Context) -> None:  # noqa: B027 - optional hook
        """Release engine resources of a request the caller cancelled."""

    async def drain(self) -> None:  # noqa: B027 - optional hook
        """Finish in-flight work before shutdown; new requests are no longer routed here."""

    @abc.abstractmethod
    async def cleanup(self) -> None:
        """Release everything; safe after a partial start and when called twice."""
