"""One embedding model as the frontend sees it: OpenAI `input` in, one vector per item out.

The frontend tokenizes (the card's tokenizer, as for generation) so a request is checked before
any worker sees it — empty items, token ids outside the vocabulary, items longer than the
context, `dimensions` on a model that cannot truncate — each a `RequestValidationError` naming
the field. The backend is an embedding engine in this process, or a router over embedding
workers (frontend/remote.py `RemoteEmbedder`).
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenizers import Tokenizer

from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.preprocessor import (
    CONTEXT_LENGTH_EXCEEDED,
    OUT_OF_VOCABULARY,
    UNSUPPORTED_BY_MODEL,
    RequestValidationError,
)
from dynamo_graph.llm.protocol import EmbeddingOutput, PreprocessedEmbeddingRequest
from dynamo_graph.runtime.context import Context

# OpenAI's limit on items per request.
MAX_INPUTS = 2048
DIMENSIONS_CAPABILITY = "embedding_dimensions"
_SHAPES = "input must be a string, a list of strings, a list of token ids or a list of token-id lists"


class Embedder(Protocol):
    async def embed(self, request: PreprocessedEmbeddingRequest, context: Context) -> EmbeddingOutput: ...


class EmbeddingPipeline:
    """Tokenizes and checks a request (`prepare`), then has the backend embed it (`embed`)."""

    def __init__(self, card: ModelDeploymentCard, tokenizer: Tokenizer, backend: Embedder) -> None:
        self.card = card
        self.backend = backend
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._encode_batch = tokenizer.encode_batch

    @property
    def name(self) -> str:
        return self.card.display_name

    def prepare(self, items: str | list[Any], dimensions: int | None = None) -> PreprocessedEmbeddingRequest:
        token_ids = self._token_ids(items)
        ctx = self.card.context_length
        for i, ids in enumerate(token_ids):
            if not ids:
                raise RequestValidationError(f"input[{i}] is empty: nothing to embed", "input")
            if ctx and len(ids) > ctx:
                raise RequestValidationError(
                    f"This model's maximum context length is {ctx} tokens, however input[{i}] has "
                    f"{len(ids)} tokens. Please reduce the length of the input.",
                    "input",
                    CONTEXT_LENGTH_EXCEEDED,
                )
        if dimensions is not None and DIMENSIONS_CAPABILITY not in self.card.capabilities:
            raise RequestValidationError(
                f"model {self.name!r} does not support `dimensions` (its vectors cannot be shortened)",
                "dimensions",
                UNSUPPORTED_BY_MODEL,
            )
        return PreprocessedEmbeddingRequest(model=self.name, token_ids=token_ids, dimensions=dimensions)

    async def embed(self, request: PreprocessedEmbeddingRequest, context: Context) -> EmbeddingOutput:
        out = await self.backend.embed(request, context)
        if len(out.embeddings) != len(request.token_ids):
            raise RuntimeError(
                f"the engine answered {len(out.embeddings)} vectors for {len(request.token_ids)} inputs"
            )
        return out

    def _token_ids(self, items: str | list[Any]) -> list[list[int]]:
        if isinstance(items, str):
            items = [items]
        if not items:
            raise RequestValidationError("input must not be empty", "input")
        if len(items) > MAX_INPUTS:
            raise RequestValidationError(f"input holds {len(items)} items; at most {MAX_INPUTS}", "input")
        if all(type(x) is int for x in items):
            return [self._checked(items, 0)]
        if all(isinstance(x, str) for x in items):
            empty = next((i for i, x in enumerate(items) if not x), None)
            if empty is not None:
                raise RequestValidationError(f"input[{empty}] is an empty string: nothing to embed", "input")
            return [e.ids for e in self._encode_batch(items, add_special_tokens=True)]
        if all(isinstance(x, list) for x in items):
            for i, ids in enumerate(items):
                if not all(type(t) is int for t in ids):
                    raise RequestValidationError(f"input[{i}]: {_SHAPES}", "input")
            return [self._checked(ids, i) for i, ids in enumerate(items)]
        raise RequestValidationError(_SHAPES, "input")

    def _checked(self, ids: list[int], index: int) -> list[int]:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestValidationError(
                f"input[{index}] holds token id {bad}, outside this model's vocabulary "
                f"[0, {self.vocab_size})",
                "input",
                OUT_OF_VOCABULARY,
            )
        return ids
