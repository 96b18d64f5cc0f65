"""The engine contract of an embedding worker (`--embedding`), beside `LLMEngine`'s generation.

An embedding engine takes a `PreprocessedEmbeddingRequest` (one token-id list per input; the
frontend tokenizes, as for generation) and answers one `EmbeddingOutput`: a pooled, unit-length
vector per input, in input order, truncated to `dimensions` when asked. Its `start()` reports
`model_type=["embedding"]`, so the worker serves `embed` on its endpoint instead of `generate`
and the card tells frontends to route `/v1/embeddings` there (Dynamo's `ModelType.Embedding`).
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

from dynamo_graph.backend.engine import EngineConfig, LLMEngine
from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.llm.embeddings import DIMENSIONS_CAPABILITY
from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.llm.protocol import EmbeddingOutput, LLMEngineOutput, PreprocessedEmbeddingRequest
from dynamo_graph.runtime.context import Context

EMBEDDING_MODEL_TYPE = ["embedding"]


class EmbeddingEngine(LLMEngine):
    """An engine that computes embeddings; see the module docstring."""

    @abc.abstractmethod
    async def embed(self, request: PreprocessedEmbeddingRequest, context: Context) -> EmbeddingOutput:
        """One unit-length vector per input of `request.token_ids`, in order."""

    def generate(self, request: Any, context: Context) -> AsyncIterator[LLMEngineOutput]:
        raise InvalidArgument(
            f"{type(self).__name__} computes embeddings; it does not generate", param="model"
        )

    def health_check_request(self, config: EngineConfig) -> dict[str, Any] | None:
        return {"model": config.served_model_name or "health_check", "token_ids": [[1]]}


def unit_vector(values: Sequence[float], dimensions: int | None = None) -> list[float]:
    """The first `dimensions` values (all when None), scaled to length 1 as OpenAI's are; a zero
    vector stays zero."""
    vector = list(values[:dimensions] if dimensions else values)
    norm = math.sqrt(math.fsum(v * v for v in vector))
    return [v / norm for v in vector] if norm > 0 else vector


def check_embedding_request(
    request: PreprocessedEmbeddingRequest | AnyRequest, vocab_size: int, context_length: int | None
) -> PreprocessedEmbeddingRequest:
    """What every engine must refuse before computing: another request type, an empty input,
    token ids outside the vocabulary (llama.cpp aborts the process on one), an input too long."""
    if not isinstance(request, PreprocessedEmbeddingRequest):
        raise InvalidArgument("an embedding engine takes pre-processed embedding requests", param="model")
    if not request.token_ids:
        raise InvalidArgument("input must hold at least one item", param="input")
    for i, ids in enumerate(request.token_ids):
        if not ids:
            raise InvalidArgument(f"input[{i}] is empty: at least one token is needed", param="input")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"input[{i}] holds token id {bad}, outside the vocabulary (0..{vocab_size - 1})",
                param="input",
            )
        if context_length and len(ids) > context_length:
            raise InvalidArgument(
                f"input[{i}] has {len(ids)} tokens; this model embeds at most {context_length}", param="input"
            )
    if request.dimensions is not None and request.dimensions < 1:
        raise InvalidArgument(f"dimensions must be at least 1, not {request.dimensions}", param="dimensions")
    return request


__all__ = [
    "DIMENSIONS_CAPABILITY",
    "EMBEDDING_MODEL_TYPE",
    "EmbeddingEngine",
    "check_embedding_request",
    "unit_vector",
]
