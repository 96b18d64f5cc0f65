"""The unified engine contract every engine implements (DESIGN.md, "Engine contract").

An engine is started once, then serves many concurrent `generate` calls, each an async
generator of `LLMEngineOutput` chunks whose last chunk carries a finish reason. Engines of
Tokens-input models receive a `PreprocessedRequest`; engines of Text-input models (which do
their own templating) receive the OpenAI request and put text in their chunks.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Literal

import msgspec

from dynamo_graph.backend.protocol import LLMEngineOutput, PreprocessedRequest
from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.inputs.config import RunConfig
    from dynamo_graph.llm.model_source import LocalModel
    from dynamo_graph.router.kv.publisher import KvEventSink

ModelInput = Literal["tokens", "text"]


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


class LLMEngine(abc.ABC):
    # Engines that report their KV cache (for kv routing) say so; the process serving them then
    # sets `kv_event_sink` before `start()`. It stays None when nobody listens (e.g. in=http).
    publishes_kv_events: bool = False
    kv_event_sink: KvEventSink | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig, model: LocalModel | None) -> LLMEngine:
        """Build the engine from the command line's settings and the resolved model."""
        return cls()

    @abc.abstractmethod
    async def start(self, worker_id: int = 0) -> EngineConfig:
        """Load whatever the engine needs; called once before any generate."""

    @abc.abstractmethod
    def generate(
        self, request: PreprocessedRequest | AnyRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """Stream chunks for one request; stop early once `context.is_stopped()`."""

    async def abort(self, context: Context) -> None:  # noqa: B027 - optional hook
        """Release engine resources of a request the caller cancelled."""

    async def drain(self) -> None:  # noqa: B027 - optional hook
        """Finish in-flight work before shutdown; new requests are no longer routed here."""

    @abc.abstractmethod
    async def cleanup(self) -> None:
        """Release everything; safe after a partial start and when called twice."""
